"""Draft-head training: `onespec train eagle3|peagle` and `train_eagle3(TrainConfig)`."""
from onespec.train.trainer import TrainConfig, train_eagle3

__all__ = ["TrainConfig", "train_eagle3"]
