"""Integrations with training frameworks. Import the one you use: ``import swapopt.integrations.mmengine``."""
