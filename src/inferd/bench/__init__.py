"""`inferd bench`: the open-loop load generator, its answer checker and its report."""
