"""hicache.engine"""
