import sys

from cleave_cli.main import main

sys.exit(main())
