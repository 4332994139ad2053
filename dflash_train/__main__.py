from dflash_train.cli import main

raise SystemExit(main())
