variable "image_id" {
  description = "Glance image id (Debian 12 or Ubuntu 22.04/24.04)."
  type        = string
}

variable "public_key" {
  description = "OpenSSH public key for the instances."
  type        = string
}

variable "external_network_id" {
  description = "External network id for the router."
  type        = string
}
