"""``python -m ddpkit ...`` is the ``ddpkit`` command."""
from ddpkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
