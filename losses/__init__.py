"""microrl.losses"""
