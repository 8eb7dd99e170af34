import sys

from runlm.launch import main

sys.exit(main())
