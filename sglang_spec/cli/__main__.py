from sglang_spec.cli import main

raise SystemExit(main())
