"""The Ray layer: Ray's start (``cluster``), one placement group (``placement``), the
training ranks (``RayTrainGroup``) and the rollout engines (``EngineGroup``) as Ray
actors on it, and the errors the loop catches from them (``errors``)."""
