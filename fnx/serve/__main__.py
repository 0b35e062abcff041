"""`python -m fnx.serve`: the OpenAI-compatible server is not implemented yet; say so clearly and exit."""

import sys


def main() -> int:
    print("fnx.serve: the OpenAI-compatible server is not implemented yet (tracked as the serving issue). "
          "Today fnx offers the model API: fnx.load(path) and fnx.forward(model, token_ids).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
