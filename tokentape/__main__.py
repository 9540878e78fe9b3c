from tokentape.cli import main

raise SystemExit(main())
