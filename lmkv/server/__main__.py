from lmkv.server.main import main

raise SystemExit(main())
