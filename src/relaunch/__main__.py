from relaunch.cli import main

raise SystemExit(main())
