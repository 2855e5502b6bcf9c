"""Ray placement: the training ranks (``RayTrainGroup``) and the rollout engines
(``EngineGroup``) as Ray actors laid out by one placement group."""
