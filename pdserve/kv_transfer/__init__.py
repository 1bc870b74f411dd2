"""pdserve.kv_transfer"""
