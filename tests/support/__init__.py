"""What tests share: fakes, fixtures, process starters and builders. Test modules import from here, never
from one another; nothing under services/ imports from here."""
