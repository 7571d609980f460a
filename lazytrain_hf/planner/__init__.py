"""The LazyTrain planner: hardware profiles, cost model, MILP, baselines, simulator. Pure data: no Trainer import."""
