"""``python -m microrl RECIPE ...`` (and ``torchrun -m microrl RECIPE ...``): the ``microrl``
command (:func:`microrl.recipes.main`)."""

import sys

from microrl.recipes import main

if __name__ == "__main__":
    sys.exit(main())
