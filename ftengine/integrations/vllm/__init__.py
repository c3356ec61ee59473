"""ftengine inside vLLM: the plugin (``plugin``), and what runs in each of vLLM's processes:
``worker/``, ``engine_core/``, ``api_server/``; ``patches/`` lists the vLLM names replaced."""
