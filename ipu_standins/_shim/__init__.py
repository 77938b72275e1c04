"""The directory ``ipu-unit-scaling emulate`` puts first on ``PYTHONPATH``: its
:mod:`sitecustomize` serves the stand-ins to every interpreter the program starts, the program's
own included (spawned and forkserver workers, ``python -c "import poptorch"``)."""
