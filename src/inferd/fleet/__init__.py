"""The fleet: how many workers each model should have (autoscaler), and the launchers that make it so."""
