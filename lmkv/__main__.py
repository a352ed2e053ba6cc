from lmkv.cli.main import main

raise SystemExit(main())
