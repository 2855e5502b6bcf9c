"""A run's setup: builders that each make one part of a run and return it.

Where it fits: ``vime.trainer.run`` calls ``vime.setup.run.build_run``, which calls the
builders in order and returns the ``RunParts`` (``parts.py``) that
``vime.trainer.Run``, the loop, works with: ``data.py`` the model, tokenizer, task,
tools, prompts and reward; ``actors.py`` Ray, the placement, the training ranks and
the engines; ``run.py`` the rollout source, the weight transport, the step timing and
the tracker; ``settings.py`` what each of them and the loop take, converted from the
flags in ``vime.config``. Kept free of imports: the modules import each other's parts.
"""
