"""``python -m onnxpack.cli``: the ``onnxpack`` command."""

import sys

from onnxpack.cli import main

sys.exit(main())
