from common.cli import main

raise SystemExit(main())
