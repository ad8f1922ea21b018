"""`kvrelay up`: launch a whole stack under supervisord and watch it come up."""
