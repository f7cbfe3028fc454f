terraform {
  # terraform_data (1.4) and cross-variable validation references (1.9) are both used.
  required_version = ">= 1.9"
}
