"""hicache.index"""
