from common.app.cli import main

raise SystemExit(main())
