import sys

from prorl_server.cli import main

sys.exit(main())
