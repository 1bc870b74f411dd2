"""pdserve.sim"""
