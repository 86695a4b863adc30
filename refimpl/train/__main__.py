"""`python -m refimpl.train`: the command of `refimpl.train.cli`."""

from .cli import main

if __name__ == "__main__":
    main()
