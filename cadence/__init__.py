"""cadence: a fastai-style Learner whose one event loop trains on one device or many."""

__version__ = "0.1.0"
