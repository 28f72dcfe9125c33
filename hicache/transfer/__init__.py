"""hicache.transfer"""
