"""``python -m ckptzip``: the same command line as the ``ckptzip`` script."""
from .cli import main

if __name__ == "__main__":
    main()
