"""`python -m fnx.serve`: the OpenAI-compatible server (see `python -m fnx.serve --help`)."""

import sys

from fnx.serve.server import main

if __name__ == "__main__":
    sys.exit(main())
