__version__ = "0.18.6"
