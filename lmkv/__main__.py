from lmkv.cli import main

raise SystemExit(main())
