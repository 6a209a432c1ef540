"""``python -m onnxpack``: the ``onnxpack`` command (as installed by ``pip``)."""

import sys

from onnxpack.cli import main

sys.exit(main())
