from moefold.cli import main

raise SystemExit(main())
