"""hicache.tiers"""
