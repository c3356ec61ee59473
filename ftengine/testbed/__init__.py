"""The test bed: everything that exercises the product without being part of it.

The home-made CPU reference cluster (``cluster``, its CPU backend ``cpu``, its HTTP server
``control``), the chaos campaigns (``chaos``), every benchmark (``bench``), the real-vLLM
launcher and demo (``vllm``) and their commands (``cli``, found by ``ftengine``'s command
line through the ``ftengine.commands`` entry-point group). It imports the product; no
product module imports it (``tests/unit/test_import_graph.py``). Its third-party needs
come with the ``testbed`` extra: ``pip install 'ftengine[testbed]'``.
"""
