import sys

from art_integrations.wizard.cli import main

sys.exit(main())
