from memgas.jobs.cli import main

raise SystemExit(main())
