"""microrl.engine"""
