from phloem.cli import main

raise SystemExit(main())
