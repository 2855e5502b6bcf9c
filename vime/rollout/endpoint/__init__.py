"""The OpenAI-compatible endpoint of ``--agent-function-path``: ``server.py`` serves the
run's engines over HTTP, ``capture.py`` records each trajectory's requests as token ids,
``agent.py`` is the generate function that runs the user's agent against it."""
