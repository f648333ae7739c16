"""``python -m ddpkit ...`` is the ``ddpkit`` command."""
from ddpkit.cli import console

if __name__ == "__main__":
    console()
