"""microrl.kernels"""
