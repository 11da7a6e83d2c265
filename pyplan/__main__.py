from pyplan.cli.main import main

raise SystemExit(main())
