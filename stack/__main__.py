from stack.cli import main

raise SystemExit(main())
