"""The trainbot control plane: service layer, lifecycle, providers, scheduler."""
