from lmkv.cli.commands import main

raise SystemExit(main())
