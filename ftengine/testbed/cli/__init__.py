"""The test bed's commands: ``demo``, ``serve``, ``checkpoint``, ``chaos``, ``chaos-vllm``,
``vllm`` and ``bench ...``. ``ftengine``'s command line (:mod:`ftengine.cli`) finds this
package through the ``ftengine.commands`` entry point; its modules follow the same
``COMMAND`` / ``BENCH`` and ``register(parser)`` contract as the product's."""
