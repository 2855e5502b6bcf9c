"""The built-in tool loop (``--tools``), a generate function of the multi-turn seam
(``vime.rollout.agent``): ``loop.py`` runs the turns, ``toolbox.py`` loads and runs the
tools and parses calls, ``turns.py`` renders the environment's turns as token ids, and
``parsers.py`` names the ``--tool-parser`` choices (no torch: the parser imports it)."""
